"""`dilocox linkcheck`: the emulated slow link against a Linux link shaped with `tc tbf` (root only, optional)."""
