"""The wheel's packages, found rather than listed (a hand list once shipped a wheel without
bagualu_plugin.sim; editable installs hid it). setuptools' find sees folders only, so the two
top-level folders that ship inside the package (docs/architecture.md) are mapped here and their
packages named from the mapping; everything else about the build is in pyproject.toml."""

from setuptools import find_packages, setup

# recipes/ ships inside the package, so `bagualu curve glm-423b-a30b` finds the built-in recipes from
# any install (their YAML is pyproject's package-data); kernels/ is imported as bagualu_plugin.kernels,
# never as a top-level `kernels` module: the HF `kernels` package owns that name.
PACKAGE_DIR = {"bagualu_plugin.recipes": "recipes", "bagualu_plugin.kernels": "kernels"}

packages = find_packages(include=["bagualu_plugin", "bagualu_plugin.*"])
for name, folder in PACKAGE_DIR.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(packages=packages, package_dir=PACKAGE_DIR)
