"""Built-in recipes, shipped inside the package as `bagualu_plugin.recipes`."""
