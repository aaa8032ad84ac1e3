"""kvbus kvbus stage."""
