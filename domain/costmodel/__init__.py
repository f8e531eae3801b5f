"""Cost curves, acceptance statistics and the choice of draft cap from them."""
