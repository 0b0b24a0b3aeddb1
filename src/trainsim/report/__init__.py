"""Stage 7: one self-contained HTML page and flat metrics per configuration point."""
