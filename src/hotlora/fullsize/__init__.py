"""The full-size models' published configurations, as Python dicts (one module per model):
what ``hotlora plan`` builds on the meta device and the full-size runs build with random weights."""
