"""API dialect codecs, one package per dialect; they never import each other."""
