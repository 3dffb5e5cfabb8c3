"""Hardware, cluster and calibration profiles: data files, each number with its source."""
