// Package regularfile reads a file an operator names (a manifest, a
// configuration file) without letting the file decide what the reading
// costs: only a regular file is read, never a named pipe, a device or a
// socket, whose open or read may block for ever or never end; and at most a
// limit of bytes, counted on what is read rather than on the size the file
// reports (a file in /proc reports 0 bytes, and a file may grow).
//
//	data, err := regularfile.Read(path, 4<<20, "configuration file")
//	if errors.Is(err, regularfile.ErrNotRegular) || errors.Is(err, regularfile.ErrTooLarge) { ... }
package regularfile

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// ErrNotRegular is the error of a file that is not a regular one: it is not
// opened for reading.
var ErrNotRegular = errors.New("not a regular file")

// ErrTooLarge is the error of a file larger than the limit: it is not read.
var ErrTooLarge = errors.New("too large")

// Read reads the regular file name, refusing any other kind of file and any
// file larger than limit bytes; what names such a file in the error ("manifest
// file"). The errors say what the file is, not its name.
func Read(name string, limit int64, what string) ([]byte, error) {
	// Checked before opening: opening a named pipe waits for a writer, and
	// opening a device may have effects of its own.
	info, err := os.Stat(name)
	if err != nil {
		return nil, err
	}
	if err := check(info, limit, what); err != nil {
		return nil, err
	}
	// O_NONBLOCK so that a file replaced by a named pipe since the Stat does
	// not block the open until a writer comes; it changes nothing for a
	// regular file.
	f, err := os.OpenFile(name, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if info, err = f.Stat(); err != nil {
		return nil, err
	}
	if err := check(info, limit, what); err != nil {
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
		return nil, &sizeError{limit, what}
	}
	return data, nil
}

// check reports why the file of info is not read, or nil.
func check(info fs.FileInfo, limit int64, what string) error {
	if !info.Mode().IsRegular() {
		return fmt.Errorf("%w (%s): not read", ErrNotRegular, kind(info.Mode()))
	}
	if info.Size() > limit {
		return &sizeError{limit, what}
	}
	return nil
}

// sizeError is ErrTooLarge with the limit.
type sizeError struct {
	limit int64
	what  string
}

func (e *sizeError) Error() string {
	return fmt.Sprintf("larger than the limit of %s for a %s: not read", byteSize(e.limit), e.what)
}

func (e *sizeError) Is(target error) bool { return target == ErrTooLarge }

// byteSize writes n in MiB when it is a whole number of them.
func byteSize(n int64) string {
	if n >= 1<<20 && n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d bytes", n)
}

// kind names the kind of a file that is not a regular one.
func kind(m fs.FileMode) string {
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
