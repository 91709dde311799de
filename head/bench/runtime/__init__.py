"""`tether bench runtime`: RPC, cold start and Sample transfer against raw pyzmq and Ray, with
the Python actors and the Sample codec only this benchmark uses."""
