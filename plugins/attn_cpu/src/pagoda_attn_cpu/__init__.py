"""Paged attention for the CPU: a C++/OpenMP kernel that reads K/V straight from the block cache."""
