"""`tokenmill bench`: a load generator for any OpenAI-compatible server (a client process).

It runs in the caller's process, never inside the server: `datasets` builds the prompts,
`client` sends them over HTTP and times the streamed chunks, `metrics` aggregates the
results, and `command` wires the flags together. Nothing is imported here, so that
`tokenmill --help` does not pay for aiohttp and numpy.
"""
