join <(awk '{print $1"/"$2, $3, $4}' $1 | sort) <(awk '{print $1"/"$2, $3, $4}' $2 | sort) | awk '{d=$5-$3; if (d>0) print $1, $2, d}' | sort -k3 -n -r
