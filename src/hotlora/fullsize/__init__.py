"""Full-size models built offline from their published configurations, with random weights."""
