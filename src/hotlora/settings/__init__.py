"""Typed settings, each declared once (see ``hotlora.config`` for the map)."""
