"""Fakes of the ports, swapped in through bootstrap.build; never imported by production code."""
