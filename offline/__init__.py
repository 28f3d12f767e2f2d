"""In-process generation with no server (engine.py): the controller's scheduling driving a
ModelRunner directly. It stands above both processes' code, so neither imports it."""
