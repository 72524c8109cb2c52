# Throughput against clients: each scenario of oncepay over HTTP next to its
# own anchor (pgbench on the least SQL, the HTTP ceiling, pgbench's
# primary-key lookup), with pgbench on the service's very SQL dashed beside
# it where there is one. One panel per scenario; the series are the blocks
# of chart.dat, in the order bench/report.py writes them. Called by
# bench/report.py with -e "data=...; out=...; subtitle=...".
set terminal pngcairo size 1300,1150 font "sans,10"
set output out
set multiplot layout 2,2 title "oncepay against its anchors, " . subtitle
set logscale x 2
set xrange [0.8:160]
set xtics (1, 8, 32, 128)
set xlabel "concurrent clients"
set ylabel "requests (transactions) per second"
set yrange [0:*]
set grid
set key outside below vertical
set bmargin 8
set style data linespoints

set title "new charges"
plot data index 0 using 1:2 title "oncepay" lw 2 pt 7, \
     data index 1 using 1:2 title "anchor: minimum.sql + gateway.sql + HTTP hop" lw 2 pt 5 dt 2, \
     data index 2 using 1:2 title "new\\_charge.sql + gateway.sql + HTTP hop (the service's SQL)" lw 1 pt 4 dt 3

set title "replays from the replay cache"
plot data index 3 using 1:2 title "oncepay" lw 2 pt 7, \
     data index 4 using 1:2 title "anchor: the HTTP ceiling (same bytes, no work)" lw 2 pt 5 dt 2

set title "replays missing the cache (REPLAY\\_CACHE\\_BYTES=0)"
plot data index 5 using 1:2 title "oncepay" lw 2 pt 7, \
     data index 6 using 1:2 title "anchor: pgbench pk\\_lookup.sql" lw 2 pt 5 dt 2, \
     data index 7 using 1:2 title "pgbench replay.sql (the service's SQL)" lw 1 pt 4 dt 3

set title "retry storm (90% retries of 100 hot keys)"
plot data index 8 using 1:2 title "oncepay" lw 2 pt 7, \
     data index 9 using 1:2 title "anchor: pgbench, the same SQL" lw 2 pt 5 dt 2
unset multiplot
