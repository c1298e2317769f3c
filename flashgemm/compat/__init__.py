"""Entry points with other libraries' argument conventions, so a serving
stack that calls them can switch by import."""
