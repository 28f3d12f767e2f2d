"""The HTTP application (main process): routes and /metrics."""
