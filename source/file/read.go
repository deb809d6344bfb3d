package file

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// DefaultMaxFileSize bounds what is read of one manifest file: 64 MiB, about
// 100k Services with their EndpointSlices, far more than one proxy serves. A
// larger file, or a link to an endless one such as /dev/zero, would otherwise
// take the process's memory.
const DefaultMaxFileSize = 64 << 20

// ErrNotRegular is the error of a manifest that is not a regular file (a
// named pipe, a device, a socket): such a file is not opened for reading, as
// reading one may block for ever or never end.
var ErrNotRegular = errors.New("not a regular file")

// ErrTooLarge is the error of a manifest file larger than the limit
// (Source.MaxFileSize): it is not read.
var ErrTooLarge = errors.New("too large")

// ErrEmpty is the error of a manifest file of 0 bytes. Its last content is
// used: "cmd > file" empties the file before cmd writes, and leaves it empty
// when cmd fails or the disk is full, and neither should take its Services
// away. A file that holds only a comment is read as one without objects.
var ErrEmpty = errors.New(`empty (0 bytes): taken for a file being written, its last content is used; to remove its objects, write a comment such as "# none" into it`)

// readRegular reads the regular file name, refusing any other kind of file
// and any file larger than limit bytes. The limit is enforced on what is
// read, not on the size the file reports: a file in /proc reports 0 bytes,
// and a file may grow while it is read.
func readRegular(name string, limit int64) ([]byte, error) {
	// Checked before opening: opening a device may have effects of its own.
	info, err := os.Stat(name)
	if err != nil {
		return nil, err
	}
	if err := checkRegular(info, limit); err != nil {
		return nil, err
	}
	// O_NONBLOCK so that a file replaced by a named pipe since the Stat
	// does not block the open until a writer comes; it changes nothing
	// for a regular file.
	f, err := os.OpenFile(name, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if info, err = f.Stat(); err != nil {
		return nil, err
	}
	if err := checkRegular(info, limit); err != nil {
		return nil, err
	}
	// As os.ReadFile: into a buffer of the size the file reports, grown
	// only if it grows.
	r := io.LimitReader(f, limit+1)
	data := make([]byte, 0, min(info.Size(), limit)+512)
	for {
		if len(data) == cap(data) {
			data = append(data, 0)[:len(data)]
		}
		n, err := r.Read(data[len(data):cap(data)])
		data = data[:len(data)+n]
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	if int64(len(data)) > limit {
		return nil, tooLarge(limit)
	}
	return data, nil
}

// checkRegular reports why the file of info is not read, or nil.
func checkRegular(info fs.FileInfo, limit int64) error {
	if !info.Mode().IsRegular() {
		return fmt.Errorf("%w (%s): not read", ErrNotRegular, fileKind(info.Mode()))
	}
	if info.Size() > limit {
		return tooLarge(limit)
	}
	return nil
}

func tooLarge(limit int64) error { return &sizeError{limit} }

// sizeError is ErrTooLarge with the limit.
type sizeError struct{ limit int64 }

func (e *sizeError) Error() string {
	return fmt.Sprintf("larger than the limit of %s for a manifest file: not read", byteSize(e.limit))
}

func (e *sizeError) Is(target error) bool { return target == ErrTooLarge }

// byteSize writes n in MiB when it is a whole number of them.
func byteSize(n int64) string {
	if n >= 1<<20 && n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d bytes", n)
}

// fileKind names the kind of a file that is not a regular one.
func fileKind(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeCharDevice != 0:
		return "a character device"
	case m&fs.ModeDevice != 0:
		return "a block device"
	}
	return "mode " + m.String()
}
