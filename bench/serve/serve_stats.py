"""Helpers shared by the serving scripts of this folder: percentiles of a latency list and a JSON GET."""
import json
import statistics
import urllib.request


def percentiles(xs):
    """n, p50, p90, p99, max and mean of xs (seconds); nearest-rank on the sorted list; {"n": 0} when empty."""
    if not xs:
        return {"n": 0}
    xs = sorted(xs)

    def q(p):
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

    return {"n": len(xs), "p50": q(50), "p90": q(90), "p99": q(99), "max": xs[-1], "mean": statistics.fmean(xs)}


def get_json(url, path, api_key):
    """GET url + path with a Bearer key; the decoded JSON body. Raises urllib's errors (HTTPError, URLError)."""
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())
