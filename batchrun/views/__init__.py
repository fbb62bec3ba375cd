"""Views of a run directory: the HTML report and the live status; they only read."""
