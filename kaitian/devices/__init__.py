"""Devices: the vendor table, this host's inventory, selection and this rank's device."""
