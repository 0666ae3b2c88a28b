"""Guide families, each with the signature of its model."""

from pyro_trees.guides.vart import TemperatureSchedule, VaRTGuide

__all__ = ["TemperatureSchedule", "VaRTGuide"]
