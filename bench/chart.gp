# Throughput against clients, oncepay over HTTP and pgbench on the same SQL,
# one panel per scenario. Called by bench/report.py with -e "data=...; out=...; subtitle=...".
set terminal pngcairo size 1500,520 font "sans,10"
set output out
set multiplot layout 1,3 title "oncepay vs the Postgres limit (pgbench, same SQL), " . subtitle
set logscale x 2
set xrange [0.8:160]
set xtics (1, 8, 32, 128)
set xlabel "concurrent clients"
set ylabel "requests (transactions) per second"
set yrange [0:*]
set grid
set key outside below
set style data linespoints

set title "new charges"
plot data index 0 using 1:2 title "oncepay" lw 2 pt 7, \
     data index 1 using 1:2 title "pgbench, same SQL" lw 2 pt 5 dt 2

set title "replays of completed keys"
plot data index 2 using 1:2 title "oncepay" lw 2 pt 7, \
     data index 3 using 1:2 title "pgbench, same SQL" lw 2 pt 5 dt 2, \
     data index 4 using 1:2 title "pgbench, primary-key lookup" lw 2 pt 9 dt 3

set title "retry storm (90% retries of 100 hot keys)"
plot data index 5 using 1:2 title "oncepay" lw 2 pt 7, \
     data index 6 using 1:2 title "pgbench, same SQL" lw 2 pt 5 dt 2
unset multiplot
