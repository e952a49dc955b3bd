# The relay inside a sandbox with egress: its init (pid 1), the proxy's port on loopback.
#
# Run by bubblewrap (`--as-pid-1`) as `perl -- relay.pl SOCKET PORT PRCTL`, with no module at
# all (perl-base's interpreter starts in ~2 ms where Python's takes ~12 ms; a sandbox with
# egress pays it on every start, or its pooled start does). It binds PORT on 127.0.0.1 and
# ::1, then reads its command on fd 6 exactly as the stub of a sandbox started ahead does
# (sandbox/argv.py STUB_PROGRAM: the directory, "i" or "n", the counts, the variables, the
# argv; NUL-terminated): a sandbox started for its call finds it there at once, one started
# ahead of need when a call takes it. It then starts the command and carries every connection
# to PORT over to SOCKET (the host proxy's socket for this sandbox), byte for byte; it decides
# nothing itself. egress/relay.py is the same relay in Python (environment builds use it).
#
# The command cannot replace it: as the pid namespace's init it ignores every signal it has
# no handler for (SIGKILL included) when it comes from inside; it is not dumpable
# (prctl(PR_SET_DUMPABLE, 0), syscall number PRCTL for this architecture, given by the
# server), so its memory is not the command's to write; the port is bound without
# SO_REUSEPORT. Every descriptor it opens is close-on-exec (perl's $^F). If the command ends,
# so does the relay, with the command's status (128+N for signal N), and the kernel ends the
# rest of the sandbox. The relay writes nothing to the command's stdout or stderr.
#
# Linux's numbers, the same on every architecture the server accepts (egress_port.py); plain
# subs, not `use constant` (loading it would double the start).
sub AF_UNIX () { 1 } sub AF_INET () { 2 } sub AF_INET6 () { 10 } sub SOCK_STREAM () { 1 }
sub SOL_SOCKET () { 1 } sub SO_LINGER () { 13 } sub IPPROTO_IPV6 () { 41 }
sub IPV6_V6ONLY () { 26 } sub F_GETFL () { 3 } sub F_SETFL () { 4 } sub O_NONBLOCK () { 2048 }
sub EINTR () { 4 } sub EAGAIN () { 11 } sub ENFILE () { 23 } sub EMFILE () { 24 }
sub WNOHANG () { 1 } sub PIDFD_OPEN () { 434 } sub CHUNK () { 262144 } sub COMMAND_FD () { 6 }

my ($path, $port, $prctl) = @ARGV;
defined $prctl or do { syswrite STDERR, "relay: usage: relay.pl SOCKET PORT PRCTL\n"; exit 2 };
my @listeners;
for my $family (AF_INET, AF_INET6) {
    my $sock;
    socket($sock, $family, SOCK_STREAM, 0) or do { next if $family == AF_INET6; die "socket: $!\n" };
    my $addr;
    if ($family == AF_INET) {
        $addr = pack("S n a4 x8", AF_INET, $port, "\x7f\0\0\1");
    } else {
        setsockopt($sock, IPPROTO_IPV6, IPV6_V6ONLY, 1);
        $addr = pack("S n N a16 N", AF_INET6, $port, 0, ("\0" x 15) . "\1", 0);
    }
    unless (bind($sock, $addr) and listen($sock, 128)) {
        die "relay: cannot listen on port $port: $!\n" if $family == AF_INET;
        close $sock;
        next;  # no IPv6 loopback in this namespace
    }
    nonblocking($sock);
    push @listeners, $sock;
}
syscall($prctl, 4, 0, 0, 0, 0) if $prctl > 0;  # PR_SET_DUMPABLE 0

# The command (the stub's fields); anything but exactly that runs nothing.
open(my $c, "<&=", COMMAND_FD) or exit 125;
my $data = do { local $/; <$c> };
close $c;
defined $data and length $data or exit 125;
my @f = split /\0/, $data, -1;
pop @f;
my ($cwd, $interactive, $n, $m) = splice @f, 0, 4;
defined $m and $m > 0 and @f == 2 * $n + $m or exit 125;

my @forwarded = qw(TERM INT HUP QUIT USR1 USR2);
$SIG{CHLD} = sub { };  # (a handler: select is interrupted, orphans are reaped)
$SIG{PIPE} = "IGNORE";  # (a write to a closed connection is an error, not the end)
my $pid = fork;
defined $pid or exit 125;
if ($pid == 0) {
    $SIG{$_} = "DEFAULT" for ("CHLD", "PIPE", @forwarded);
    if ($interactive ne "i") { open(STDIN, "<", "/dev/null") or exit 125 }
    chdir $cwd or do { print STDERR "bwrap: Can't chdir to $cwd: $!\n"; exit 1 };
    for (1 .. $n) { my $k = shift @f; $ENV{$k} = shift @f }
    $ENV{PWD} = $cwd;
    exec { $f[0] } @f;
    print STDERR "bwrap: execvp $f[0]: $!\n";
    exit 1;
}
# The command's streams end when the command's processes close them (first thing: a caller
# waits for their end).
open(STDOUT, ">", "/dev/null");
open(STDERR, ">", "/dev/null");
open(STDIN, "<", "/dev/null");
for my $sig (@forwarded) { $SIG{$sig} = sub { kill $sig, $pid } }  # (the server signals it too)
# Readable once the command has ended (no lost wake-up between a check and select).
my $pidfd;
my $pfd = syscall(PIDFD_OPEN, $pid, 0);
open($pidfd, "<&=", $pfd) if $pfd >= 0;
my $spare;  # a descriptor given up to refuse one connection when every other is taken
open($spare, "<", "/dev/null");

# One connection is two ends (by descriptor number): the program's TCP socket and the proxy's
# unix socket. For each end: its socket, its peer, the bytes waiting to be written to it, and
# whether it will send nothing more (eof) or has been shut for writing.
my (%sock, %peer, %pending, %eof, %shut);

sub nonblocking {
    my ($s) = @_;
    my $flags = fcntl($s, F_GETFL, 0);
    fcntl($s, F_SETFL, ($flags || 0) | O_NONBLOCK);
}

sub reset_close {
    my ($s) = @_;
    setsockopt($s, SOL_SOCKET, SO_LINGER, pack("ii", 1, 0));
    close $s;
}

sub accept_all {
    my ($listener) = @_;
    for (1 .. 64) {
        my $client;
        unless (accept($client, $listener)) {
            return if $! == EAGAIN or $! == EINTR;
            shed($listener) if $! == EMFILE or $! == ENFILE;  # or the loop would spin
            return;
        }
        my $up;
        unless (socket($up, AF_UNIX, SOCK_STREAM, 0)) { reset_close($client); return }
        unless (connect($up, pack("S Z*", AF_UNIX, $path))) {
            # The proxy is gone (or refuses): no way out. The program sees a reset.
            close $up;
            reset_close($client);
            next;
        }
        nonblocking($_) for ($client, $up);
        my ($a, $b) = (fileno $client, fileno $up);
        @sock{$a, $b} = ($client, $up);
        @peer{$a, $b} = ($b, $a);
        @pending{$a, $b} = ("", "");
    }
}

# With every descriptor taken, accept one waiting connection on the spare one and reset it:
# the program hears a refusal instead of waiting, and the listener stops being ready.
sub shed {
    my ($listener) = @_;
    return unless $spare;
    close $spare;
    undef $spare;
    my $client;
    reset_close($client) if accept($client, $listener);
    open($spare, "<", "/dev/null") or undef $spare;
}

# `end` takes no more bytes (reset, broken pipe): drop what waits for it and stop reading its
# peer, whose bytes have nowhere to go. What `end` sent before still goes on: a proxy that
# answers and closes without reading the request (a refusal) is heard.
sub broken {
    my ($end) = @_;
    $pending{$end} = "";
    $eof{$peer{$end}} = 1;
}

sub drop {
    my @ends = ($_[0], $peer{$_[0]});  # (copies: the hash entries go in the loop)
    for my $e (@ends) {
        close $sock{$e};
        delete $sock{$e}; delete $peer{$e}; delete $pending{$e}; delete $eof{$e}; delete $shut{$e};
    }
}

sub service {
    my ($end, $readable) = @_;
    my $other = $peer{$end};
    if ($readable) {
        my $got = sysread($sock{$end}, my $data, CHUNK);
        if ($got) {
            $pending{$other} .= $data;
        } elsif (defined $got) {
            $eof{$end} = 1;
        } elsif ($! != EAGAIN and $! != EINTR) {  # reset: the end of what it sends
            $eof{$end} = 1;
            broken($end);
        }
    }
    for my $side ($end, $other) {
        if (length $pending{$side}) {
            my $sent = syswrite($sock{$side}, $pending{$side});
            if ($sent) {
                substr($pending{$side}, 0, $sent) = "";
            } elsif (!defined $sent and $! != EAGAIN and $! != EINTR) {
                broken($side);
            }
        }
        if (!length $pending{$side} and $eof{$peer{$side}} and !$shut{$side}) {
            shutdown($sock{$side}, 1);
            $shut{$side} = 1;
        }
    }
    drop($end) if $eof{$end} and $eof{$other} and !length $pending{$end} and !length $pending{$other};
}

sub reap {
    while ((my $done = waitpid(-1, WNOHANG)) > 0) {
        next unless $done == $pid;
        exit(($? & 127) ? 128 + ($? & 127) : $? >> 8);
    }
}

while (1) {
    my ($rin, $win) = ("", "");
    vec($rin, fileno $_, 1) = 1 for @listeners;
    vec($rin, fileno $pidfd, 1) = 1 if $pidfd;
    for my $end (keys %sock) {
        vec($rin, $end, 1) = 1 if !$eof{$end} and length $pending{$peer{$end}} < CHUNK;
        vec($win, $end, 1) = 1 if length $pending{$end};
    }
    # (without a pidfd, a wake-up lost between the reaping and select costs at most a second)
    my $ready = select(my $rout = $rin, my $wout = $win, undef, $pidfd ? undef : 1.0);
    reap();
    next if $ready <= 0;
    for my $listener (@listeners) {
        accept_all($listener) if vec($rout, fileno $listener, 1);
    }
    for my $end (keys %sock) {
        next unless exists $sock{$end};  # (dropped with its peer in this round)
        my ($r, $w) = (vec($rout, $end, 1), vec($wout, $end, 1));
        service($end, $r) if $r or $w;
    }
}
