"""Pyro models (``PyroModule``\\ s whose ``forward(x, y=None)`` samples inside plates)."""

__all__: list[str] = []
