"""Debugging tools: the first-divergence locator (which region first computes different bits)."""

from .locator import Divergence, first_divergence

__all__ = ["Divergence", "first_divergence"]
