"""Per-flow view of a bench-fanout run (scripts/bench/fanout-link-timeline.sh --flows).

Input: lines "EPOCH ENGINE PEER BYTES_RECEIVED", one per TCP connection of engine ENGINE
(1..K) per sample, PEER its remote address (198.18.0.1 is the trainer, 198.18.0.N+1 engine N).
For the last version of the run it prints, about once a second: what each relay had received
from the trainer (its stripe, as the origin serves it: the trainer's other traffic to it is a
few control messages) and, per relay, the mean over the other engines of what they had not yet
read of that stripe from it (the relay's lag, MiB). Then the stripes' spread and the mean lag.
"""

import collections
import re
import statistics
import sys

MIB = float(1 << 20)


def load(path):
    samples = collections.defaultdict(lambda: collections.defaultdict(int))
    for line in open(path):
        fields = line.split()
        if len(fields) != 4:
            continue
        match = re.search(r"198\.18\.0\.(\d+)", fields[2])
        if not match:
            continue
        try:
            at, engine, got = float(fields[0]), int(fields[1]), int(fields[3])
        except ValueError:
            continue
        samples[at][(engine, int(match.group(1)) - 1)] += got
    return samples


def version_starts(times, from_trainer):
    """Indexes where the trainer's bytes start to rise after a pause of more than a second."""
    starts, quiet_since = [], times[0]
    for k in range(1, len(times)):
        rising = from_trainer[k] > from_trainer[k - 1] + 100_000
        if rising and times[k - 1] - quiet_since > 1.0:
            starts.append(k - 1)
        if rising:
            quiet_since = times[k]
    return starts


def main():
    samples = load(sys.argv[1])
    times = sorted(samples)
    engines = sorted({e for at in samples.values() for (e, _) in at})
    if len(times) < 10 or len(engines) < 2:
        sys.exit("fanout_flows: too few samples (run with one K of at least 2 engines)")
    from_trainer = [sum(samples[t].get((e, 0), 0) for e in engines) for t in times]
    starts = version_starts(times, from_trainer)
    if not starts:
        sys.exit("fanout_flows: no version found in the samples")
    bounds = starts + [len(times) - 1]
    print("per version: from the trainer's first byte, each stripe's landing at its relay (s; "
          "first / last) and the readers' last byte (s), the relay read last from")
    for v in range(len(starts)):
        a, b = bounds[v], bounds[v + 1]
        landed_at, done_at = {}, {}
        for k in range(a + 1, b + 1):
            t = times[k] - times[a]
            for e in engines:
                for p in [0] + engines:
                    if (samples[times[k]].get((e, p), 0) >
                            samples[times[k - 1]].get((e, p), 0) + 65536):  # not control traffic
                        if p == 0:
                            landed_at[e] = t
                        else:
                            done_at[(e, p)] = t
        if not done_at:
            continue
        last = max(done_at, key=done_at.get)
        print(f"  version {v + 1}: stripes landed {min(landed_at.values()):5.1f} / "
              f"{max(landed_at.values()):5.1f} s, readers done {max(done_at.values()):5.1f} s, "
              f"last bytes: engine {last[0]} from relay {last[1]} (its stripe landed "
              f"{landed_at.get(last[1], 0):5.1f} s)")
    s = starts[-1]

    def since(k, engine, peer):
        return (samples[times[k]].get((engine, peer), 0) -
                samples[times[s]].get((engine, peer), 0)) / MIB

    print(f"flows of the last version (engines {engines[0]}..{engines[-1]}): per relay, its "
          "stripe received from the trainer (MiB) / the other engines' mean lag behind it (MiB)")
    lags_all, spreads, last_print = [], [], -1.0
    for k in range(s, len(times)):
        t = times[k] - times[s]
        landed = {j: since(k, j, 0) for j in engines}
        lag = {j: statistics.mean(landed[j] - since(k, i, j) for i in engines if i != j)
               for j in engines}
        total = statistics.mean(sum(landed.values()) - landed[i] -
                                sum(since(k, i, j) for j in engines if j != i)
                                for i in engines)
        if max(landed.values()) > 0.5 and min(landed.values()) < max(landed.values()):
            spreads.append(max(landed.values()) - min(landed.values()))
        if min(landed.values()) > 0.5 and total > 0.05:
            lags_all.append(total)
        if t - last_print >= 1.0:
            last_print = t
            print(f"{t:5.1f}s " + " ".join(f"{landed[j]:5.1f}/{lag[j]:3.1f}" for j in engines) +
                  f"  reader behind {total:4.1f}")
        if t > 60 or (k > s and all(v == 0 for v in lag.values()) and total <= 0.01 and t > 2):
            break
    if spreads:
        print(f"stripes' spread (fastest - slowest received at the relays): median "
              f"{statistics.median(spreads):.1f} MiB, max {max(spreads):.1f} MiB")
    if lags_all:
        print(f"a reader's bytes landed at its relays but not yet read from them: median "
              f"{statistics.median(lags_all):.1f} MiB, max {max(lags_all):.1f} MiB")


if __name__ == "__main__":
    main()
