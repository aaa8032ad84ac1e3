"""kvbus producers stage."""
