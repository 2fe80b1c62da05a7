"""Graph passes: pure functions over captured FX graphs (analysis → schedule → insert → verify)."""
