"""Compression: the codec table and CodecSet (`codecs`), zstd dictionaries (`dictionaries`,
shipped ones in `dicts/`), and the ratio estimate for live processes (`estimate`)."""
