"""The manifest: every model tensor under its canonical name, with its placements and owners."""
