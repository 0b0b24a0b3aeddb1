"""Validation against reality: ground-truth runs on this machine and published measurements (vTrain)."""
