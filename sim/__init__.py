"""Discrete-event simulator of the warmstate scheduler on a virtual clock."""
