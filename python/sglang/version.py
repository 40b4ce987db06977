__version__ = "0.5.10.post1+moespec"
