"""Pure-torch references of every op: slow, obviously right, and the tests' oracle."""
