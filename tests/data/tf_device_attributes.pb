
)/job:worker/replica:0/task:3/device:CPU:0CPU €€€€*
StreamExecutor12Tv˜ºÜþ:device: 0, name: golden@ÿÿÿÿÿÿÿÿÿ