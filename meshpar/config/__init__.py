"""Configuration: recipes (TOML -> typed sections), their keys, input errors, hardware profiles."""
