"""The API families (main process): request parsing and response shapes."""
