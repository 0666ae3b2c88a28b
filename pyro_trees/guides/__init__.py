"""Guide families, each with the signature of its model."""

from .dgp import DGPFactorisedGuide, DGPIntermediateGuide, DGPJointGuide

__all__ = ["DGPFactorisedGuide", "DGPIntermediateGuide", "DGPJointGuide"]
