"""kvbus streams stage."""
