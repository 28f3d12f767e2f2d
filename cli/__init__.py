"""The `tokenmill` command's tools (run in the user's shell, not in a server process):
the CLI, `serve`'s flags and start, make-model, generate, bench, cluster-key."""
