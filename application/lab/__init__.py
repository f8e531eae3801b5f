"""The lab: benches, the concurrency bench, drafter training, the prompt mix and the reference decoders.

Tools that measure and build; nothing on the serving path imports them (an import-linter contract). The CLI's
`bench`, `calibrate` and `train-drafter` commands and `scripts/` use them through `bootstrap`'s wiring.
"""
