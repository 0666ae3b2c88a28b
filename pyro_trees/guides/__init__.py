"""Guide families, each with the signature of its model."""

__all__: list[str] = []
