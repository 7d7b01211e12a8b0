"""The process runtime: launching local ranks, a rank's lifetime (signals, restarts), fault handling."""
