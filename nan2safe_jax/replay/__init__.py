"""Tier 2: jaxpr replay localizer."""
