"""Run directory layout, atomic trace publishing, gather/verify and the manifest."""
