"""Integration tests of the DFlash and DSpark drafters on tiny random targets."""
