"""The frontend's side of the engine (main process): the client, the launcher and
supervision of the engine's processes, replicas and nodes."""
