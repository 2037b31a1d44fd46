"""Configuration: the schema (frozen dataclasses), the file readers and the redaction of secrets."""
