"""Container images, one per resource class (ImageSpec; built by `pyflyte run --remote` / `register`)."""
