"""The shipped architectures, one module each, registered as entry points in ``pyproject.toml``."""
