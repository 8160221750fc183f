"""leanimg plugin for toyvm saves: see format.py for the format, plugin.py for the plugin."""
