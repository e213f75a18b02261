"""Debug entry points (filled in by the capture layer)."""
