"""Naming: canonical tensor names, the per-framework layout tables and the manifest of a model."""
